"""The torchtitan recipe (docs/recipes/torchtitan_checkpoint.py) on two gloo ranks.

torchtitan's CheckpointManager itself runs: saves at its interval (async and sync modes;
pinned-memory async too where CUDA is), then a fresh manager resumes from the newest step on the tiers.
Skipped when torchtitan is not installed (scripts/setup.sh installs it without its
training-only dependencies; the checkpoint manager needs only tyro besides torch).
"""

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch
from conftest import settle
from dist_utils import run_ranks

from tiered_dcp import Tier, TieredConfig

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchtitan") is None,
    reason="torchtitan is not installed (scripts/setup.sh installs it: "
    "pip install --no-deps torchtitan==0.3.0 tyro)",
)

RECIPE = Path(__file__).resolve().parents[1] / "docs" / "recipes" / "torchtitan_checkpoint.py"


def recipe():
    """The recipe file, imported as the module a user's copy of it would be."""
    if "torchtitan_checkpoint" not in sys.modules:
        spec = importlib.util.spec_from_file_location("torchtitan_checkpoint", RECIPE)
        module = importlib.util.module_from_spec(spec)
        sys.modules["torchtitan_checkpoint"] = module  # dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules["torchtitan_checkpoint"]


def make_config(root: str) -> TieredConfig:
    return TieredConfig(
        "titan",
        [Tier(f"{root}/ram/{{node}}", every=1, keep=2), Tier(f"{root}/bucket", every=4, shared=True)],
    )


class TrainState:
    """The trainer's own Stateful, as torchtitan's Trainer registers one."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, sd: dict) -> None:
        self.step = int(sd["step"])


def build(root: str, async_mode: str, seed: int):
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 8)
    adamw = ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 0.01})
    optimizers = OptimizersContainer.Config(param_groups=[adamw], implementation="for-loop").build(
        model_parts=[model]
    )
    train_state = TrainState()
    manager = (
        recipe()
        .TieredCheckpointManager.Config(
            enable=True,
            folder=f"{root}/ckpt",
            interval=2,
            async_mode=async_mode,
            keep_latest_k=0,
            tiered=make_config(root),
        )
        .build(
            dataloader=None,
            model_parts=[model],
            optimizers=optimizers,
            lr_schedulers=None,
            states={"train_state": train_state},
            sd_adapter=None,
        )
    )
    return model, optimizers, train_state, manager


def _train_then_resume(rank, world, root):
    results = {}
    # torchtitan's own _save builds a non-blocking DefaultStager for async_with_pinned_mem,
    # which needs an accelerator: that mode runs only where CUDA is
    modes = ["async", "disabled"] + (["async_with_pinned_mem"] if torch.cuda.is_available() else [])
    for mode in modes:
        run = f"{root}/{mode}"
        model, optimizers, state, manager = build(run, mode, seed=0)
        assert manager.load() is False  # nothing on the tiers yet: a fresh start
        for step in range(1, 6):
            manager.maybe_wait_for_staging()
            optimizers.zero_grad()
            model(torch.full((4, 8), float(step))).square().sum().backward()
            optimizers.step()
            state.step = step
            manager.save(step)  # at steps 2 and 4 (interval=2)
        manager.maybe_wait_for_saving()
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        manager.close()
        if mode == "async":  # the steps torchtitan's saves made, on the RAM tier
            results["ram"] = sorted(os.listdir(f"{run}/ram/0/titan"))
        # a fresh manager over another initialisation resumes from step 4
        model2, optimizers2, state2, manager2 = build(run, mode, seed=1)
        assert manager2.load() is True and state2.step == 4
        # replay step 5 from the restored state: same weights as the first run's
        optimizers2.zero_grad()
        model2(torch.full((4, 8), 5.0)).square().sum().backward()
        optimizers2.step()
        for k, v in model2.state_dict().items():
            assert torch.equal(v, saved[k]), (mode, k)
        manager2.close()
    return results


def test_torchtitan_checkpoint_manager_saves_and_resumes_through_the_tiers(tmp_path):
    results = run_ranks(_train_then_resume, 2, str(tmp_path))
    assert results[0]["ram"] == ["step_000000000002", "step_000000000004"]
    settle(make_config(str(tmp_path / "async")))
    assert (tmp_path / "async/bucket/titan/step_000000000004/COMMITTED").exists()
    assert sorted(os.listdir(tmp_path / "async/ckpt")) == ["step-2", "step-4"]  # empty dirs only
    assert not any(os.listdir(tmp_path / "async/ckpt" / d) for d in ("step-2", "step-4"))
