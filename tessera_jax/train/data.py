"""The demo's data: a small bundled text corpus and a byte-level tokenizer.

Tokens are the UTF-8 bytes of the text (vocabulary 256), so nothing is downloaded
or trained. The batch of step ``i`` depends on ``(seed, i)`` only — never on the
number of steps, devices or processes — so a resumed run sees the same data as an
uninterrupted one.
"""

from __future__ import annotations

import importlib.resources

import numpy as np

VOCAB = 256


def corpus() -> bytes:
    """The bundled corpus (``tessera_jax/train/corpus.txt``) as bytes."""
    return importlib.resources.files(__package__).joinpath("corpus.txt").read_bytes()


def encode(text: str | bytes) -> np.ndarray:
    """Text → its UTF-8 bytes as int32 tokens."""
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    return np.frombuffer(data, dtype=np.uint8).astype(np.int32)


def decode(tokens) -> str:
    """Tokens → text; byte sequences that are not valid UTF-8 show as U+FFFD."""
    return bytes(np.asarray(tokens, dtype=np.uint8).tolist()).decode("utf-8", errors="replace")


def batch(tokens: np.ndarray, step: int, *, batch_size: int, seq_len: int, seed: int) -> np.ndarray:
    """The ``(batch_size, seq_len + 1)`` windows of step ``step``: inputs are ``[:, :-1]``,
    targets ``[:, 1:]``. Window starts are drawn from a generator seeded by
    ``(seed, step)``."""
    if tokens.size < seq_len + 2:
        raise ValueError(
            f"batch: the corpus has {tokens.size} tokens, fewer than seq_len + 2 = {seq_len + 2}"
        )
    rng = np.random.default_rng((seed, step))
    starts = rng.integers(0, tokens.size - seq_len - 1, size=batch_size)
    return np.stack([tokens[s : s + seq_len + 1] for s in starts])
