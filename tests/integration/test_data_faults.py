"""Broken data files as a user meets them, through ``rlvr-lightning fit`` (``cli.main``).

Each fault either trains with a counted warning or stops at setup with a message of a few lines
that names the file, the line and the fix.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlvr_lightning.cli.main import main
from rlvr_lightning.data import DataError

CONFIG = str(Path(__file__).parents[2] / "configs" / "tiny.yaml")
NORMAL = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(1, 4)]


def _lines(rows: list[dict]) -> list[str]:
    return [json.dumps(r) for r in rows]


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _fit(tmp_path: Path, source: Path, *extra: str) -> None:
    # A separate validation file keeps every row of `source` in training.
    val = _write(tmp_path / "val.jsonl", _lines([{"prompt": "What is 7 + 1?", "answer": "8"}]))
    main(
        [
            "fit",
            "--config",
            CONFIG,
            f"--data.init_args.source={source}",
            f"--data.init_args.val_source={val}",
            f"--trainer.default_root_dir={tmp_path}",
            *extra,
        ]
    )


def _short_error(tmp_path: Path, source: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """The error a user reads: ``main``'s summary on stderr (or the raised ``DataError``)."""
    capsys.readouterr()
    try:
        _fit(tmp_path, source)
    except SystemExit as stop:  # main summarises errors in a few lines and exits 1
        assert stop.code == 1
        err = capsys.readouterr().err
        summary = err[err.index("rlvr-lightning fit: error") :].strip().splitlines()
        assert len(summary) <= 6, summary
        return "\n".join(summary)
    except DataError as error:  # a main that lets errors through: the message alone
        assert error.__cause__ is None and (error.__context__ is None or error.__suppress_context__)
        return str(error)
    pytest.fail(f"{source} trained without an error")


def test_a_100k_character_prompt_is_skipped_with_a_count_and_training_runs(tmp_path):
    rows = [NORMAL[0], {"prompt": "x" * 100_000, "answer": "0"}, *NORMAL[1:]]
    source = _write(tmp_path / "long.jsonl", _lines(rows))
    # Before the default limit this row made the first rollout allocate a 10 GB causal mask.
    # tiny: 512 positions - max_new_tokens 12 - 54 template tokens = 446; the byte tokenizer
    # counts 100k tokens for it.
    skipped = r"Skipped 1 of 4 training prompts longer than 446 tokens, the default limit"
    with pytest.warns(UserWarning, match=skipped):
        _fit(tmp_path, source, "--trainer.enable_checkpointing=true")
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["epoch=0-step=2.ckpt"]


def test_non_utf8_bytes_stop_with_file_line_and_re_encode(tmp_path, capsys):
    source = tmp_path / "latin1.jsonl"
    good = "".join(line + "\n" for line in _lines(NORMAL[:2])).encode()
    source.write_bytes(good + '{"prompt": "caf\u00e9?", "answer": "1"}\n'.encode("latin-1"))
    message = _short_error(tmp_path, source, capsys)
    assert f"{source}:3: not valid UTF-8" in message
    assert "Re-encode the file as UTF-8" in message


def test_a_lone_surrogate_is_replaced_counted_and_the_row_trains(tmp_path):
    lone = r'{"prompt": "What is 5 + 5? \ud800", "answer": "10"}'  # valid JSON, invalid text
    source = _write(tmp_path / "surrogate.jsonl", [*_lines(NORMAL), lone])
    # All four rows in the first step, so the replaced row is tokenized and rolled out.
    with pytest.warns(UserWarning, match=r"replaced lone UTF-16 surrogates .* \(first: line 4\)"):
        _fit(
            tmp_path,
            source,
            "--data.init_args.prompts_per_step=4",
            "--trainer.enable_checkpointing=true",
        )
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["epoch=0-step=2.ckpt"]


@pytest.mark.parametrize(
    ("bad_row", "where", "fix"),
    [
        ('{"question": "What is 9 + 9?", "answer": "18"}', ":3: column 'prompt'", "columns"),
        ('{"prompt": 42, "answer": "1"}', ":3: the prompt column 'prompt' must hold text", "fix"),
        (None, ": holds no rows", "Point source at"),
    ],
    ids=["missing_prompt_column", "non_string_prompt", "empty_file"],
)
def test_malformed_rows_stop_with_file_line_and_fix(tmp_path, capsys, bad_row, where, fix):
    lines = [] if bad_row is None else [*_lines(NORMAL[:1]), "", bad_row]  # row 2 is on line 3
    source = _write(tmp_path / "bad.jsonl", lines)
    message = _short_error(tmp_path, source, capsys)
    assert f"{source}{where}" in message, message
    assert fix in message
