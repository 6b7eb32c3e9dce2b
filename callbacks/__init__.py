"""Callbacks, one intervention per file. Installed as ``rlvr_lightning.callbacks``."""

if __name__ != "rlvr_lightning.callbacks":
    # With the repository root on sys.path this folder would load a second time as `callbacks`,
    # giving every class two identities (isinstance and jsonargparse then fail).
    raise ImportError(
        f"The callbacks package was imported as {__name__!r}; import it as "
        "`rlvr_lightning.callbacks` (install the project, run tests with the `pytest` command)."
    )

from rlvr_lightning.callbacks.adaptive_temperature import AdaptiveTemperature
from rlvr_lightning.callbacks.annealed_temperature import AnnealedTemperature
from rlvr_lightning.callbacks.collective_watch import CollectiveWatch
from rlvr_lightning.callbacks.completions_table import CompletionsTable
from rlvr_lightning.callbacks.export_model import ExportModel
from rlvr_lightning.callbacks.ground_truth_injection import GroundTruthInjection
from rlvr_lightning.callbacks.memory_guard import MemoryGuard
from rlvr_lightning.callbacks.mixed_policy_guidance import MixedPolicyGuidance
from rlvr_lightning.callbacks.near_future_guidance import NearFuturePolicyGuidance
from rlvr_lightning.callbacks.prediction_writer import PredictionWriter
from rlvr_lightning.callbacks.push_to_hub import PushToHub
from rlvr_lightning.callbacks.step_progress_bar import RichStepProgressBar, StepProgressBar

__all__ = [
    "AdaptiveTemperature",
    "AnnealedTemperature",
    "CollectiveWatch",
    "CompletionsTable",
    "ExportModel",
    "GroundTruthInjection",
    "MemoryGuard",
    "MixedPolicyGuidance",
    "NearFuturePolicyGuidance",
    "PredictionWriter",
    "PushToHub",
    "RichStepProgressBar",
    "StepProgressBar",
]
