"""The evaluation loaders of ``RLVRDataModule``: validation (one loader per split), test and
predict. A mixin, so the data module file keeps the splits and the training stream; it reads the
module's attributes (``val_examples``, ``instructions``, ``setup``, ...).
"""

from __future__ import annotations

from collections.abc import Callable

import lightning.pytorch as pl
from torch.utils.data import DataLoader
from typing_extensions import override

from rlvr_lightning.data.loaders import eval_loader
from rlvr_lightning.data.mixture import SourceSpec, load_test_examples, test_specs
from rlvr_lightning.data.phrasing import PARAPHRASED
from rlvr_lightning.data.prompt_limit import drop_long_prompts
from rlvr_lightning.data.prompts import collate_examples
from rlvr_lightning.data.sources import Example


class EvalLoaders(pl.LightningDataModule):
    """Validation, test and predict loaders of ``RLVRDataModule``."""

    # Set by RLVRDataModule.__init__ / setup.
    val_examples: list[Example]
    paraphrased_examples: list[Example]
    test_examples: list[Example]
    instructions: list[str | None]
    system_prompt: str | None
    val_prompts_per_batch: int
    seed: int
    specs: list[SourceSpec]
    test_split: str
    predict_on: str
    _test_specs: list[SourceSpec] | None
    _prompt_limit: Callable[[], tuple[int, str] | None]
    _token_counter: Callable[[], Callable[[str], int]]

    @property
    def val_split_names(self) -> list[str]:
        """Name of each validation loader: ``""`` (``val/accuracy``), then ``paraphrased``
        (``val/accuracy_paraphrased``) when that split is on."""
        return [""] + ([PARAPHRASED] if self.paraphrased_examples else [])

    @override
    def val_dataloader(self) -> DataLoader | list[DataLoader]:
        self.setup("validate")
        if not self.paraphrased_examples:
            return self._eval_loader(self.val_examples)
        # Its prompts hold their own instruction (phrasing.py), so none is appended.
        return [
            self._eval_loader(self.val_examples),
            self._eval_loader(self.paraphrased_examples, False),
        ]

    def _eval_loader(self, examples: list[Example], instruct: bool = True) -> DataLoader:
        size = self.val_prompts_per_batch
        chunks = [examples[i : i + size] for i in range(0, len(examples), size)]
        texts = self.instructions[0] if instruct else None
        return eval_loader(
            [collate_examples(c, self.system_prompt, texts) for c in chunks], self.seed
        )

    def load_test(self) -> list[Example]:
        """The test set (``test_source``, or the ``test_split`` of the sources), loaded once;
        prompts over the prompt limit are skipped as in training."""
        if not self.test_examples:
            specs = self._test_specs or test_specs(
                self.specs, None, self.test_split, self.specs[0].answer_format
            )
            examples = load_test_examples(specs)
            limit = self._prompt_limit()
            if limit is not None:
                examples = drop_long_prompts(
                    examples, self._token_counter(), *limit[:1], "test", limit[1]
                )
            self.test_examples = examples
        return self.test_examples

    @override
    def test_dataloader(self) -> DataLoader:
        self.setup("test")
        return self._eval_loader(self.load_test())

    @override
    def predict_dataloader(self) -> DataLoader:
        self.setup("predict")
        return self._eval_loader(
            self.load_test() if self.predict_on == "test" else self.val_examples
        )
