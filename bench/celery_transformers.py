"""The peer a team would write without Sluice: one Celery task per request running Hugging Face
`transformers.AutoModel` on the bundled MiniLM directory, fp32, the token vectors mean-pooled
over the attention mask and L2-normalised (what sentence-transformers does for this model).

    SLUICE_BENCH_CELERY_URL=redis://127.0.0.1:6379/2 OMP_NUM_THREADS=1 \\
        celery -A bench.celery_transformers worker --pool prefork --concurrency 2

It answers the task names and the output shape of `bench.celery_baseline` (`{"embedding", "dim"}`),
so the same client drives both; only the Redis DB tells them apart. Each prefork child loads the
model once, in `worker_process_init`, with one torch thread, and warms it up; the parent never
imports torch.
"""

from __future__ import annotations

from typing import Any

from celery import signals

from bench.celery_app import EMBED_TASK, TORCH_THREADS, make_app

# sentence_bert_config.json's max_seq_length: the longest input the model was trained on.
MAX_TOKENS = 256

app = make_app("sluice_bench_transformers")

_encode: Any = None


def load_transformers() -> Any:
    """A function text -> unit vector (a list of floats), over the model loaded here."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    from sluice.artifacts import MINILM_URI, resolve_artifact

    torch.set_num_threads(TORCH_THREADS)
    path = resolve_artifact(MINILM_URI)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()

    def encode(text: str) -> list[float]:
        batch = tokenizer([text], padding=True, truncation=True, max_length=MAX_TOKENS, return_tensors="pt")
        with torch.inference_mode():
            tokens = model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(tokens.dtype)
            pooled = (tokens * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
            vector: list[float] = torch.nn.functional.normalize(pooled, p=2, dim=1)[0].tolist()
        return vector

    encode("warm up the allocator and the kernels before the first task")
    return encode


@signals.worker_process_init.connect
def _load_in_child(**_: Any) -> None:
    global _encode
    _encode = load_transformers()


@app.task(name=EMBED_TASK)
def embed(text: str) -> dict[str, Any]:
    global _encode
    if _encode is None:  # a pool without worker_process_init (solo, threads)
        _encode = load_transformers()
    vector = _encode(text)
    return {"embedding": vector, "dim": len(vector)}
