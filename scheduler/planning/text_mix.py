"""The skewed length mix the frontier sweep and the benchmarks offer: 80 % of texts have 8-24
words, 20 % have 100-200 words, English-like and deterministic for a seed. Padding, and so a
batch's cost and the p99, are decided by the long texts batched beside short ones, which texts of
one length would never show."""

from __future__ import annotations

import random
from dataclasses import dataclass

_DETERMINERS = ("the", "a", "every", "this", "that", "our", "your", "my", "their", "some")
_ADJECTIVES = (
    "new", "old", "small", "large", "quick", "late", "early", "simple", "broken", "recent", "missing",
    "monthly", "online", "local", "careful", "strange", "annual", "final", "second", "public", "private",
    "blue", "heavy", "quiet", "busy", "useful", "expensive", "cheap", "direct", "open",
)
_NOUNS = (
    "customer", "order", "account", "payment", "card", "report", "team", "manager", "driver", "package",
    "invoice", "meeting", "server", "password", "office", "ticket", "delivery", "schedule", "store", "bank",
    "phone", "email", "city", "window", "student", "teacher", "doctor", "garden", "kitchen", "river",
    "market", "project", "budget", "contract", "question", "answer", "problem", "train", "flight", "hotel",
    "weekend", "morning", "company", "network", "device", "screen", "battery", "letter", "address", "price",
)
_VERBS = (
    "checked", "sent", "lost", "found", "opened", "closed", "moved", "needed", "wanted", "asked for",
    "cancelled", "updated", "reviewed", "approved", "delivered", "repaired", "signed", "paid", "booked",
    "changed", "returned", "ordered", "printed", "blocked", "replaced", "visited", "described", "shared",
)
_ADVERBS = ("yesterday", "today", "again", "quickly", "twice", "carefully", "early", "late", "finally",
            "already", "soon", "together")
_PREPOSITIONS = ("in", "at", "near", "for", "with", "from", "after", "before", "during", "without", "about")
_CONNECTIVES = ("and", "but", "because", "so", "while", "although")


def _phrase(rng: random.Random) -> list[str]:
    words = [rng.choice(_DETERMINERS)]
    if rng.random() < 0.6:
        words.append(rng.choice(_ADJECTIVES))
    words.append(rng.choice(_NOUNS))
    return words


def _clause(rng: random.Random) -> list[str]:
    words = _phrase(rng) + rng.choice(_VERBS).split() + _phrase(rng)
    if rng.random() < 0.5:
        words += [rng.choice(_PREPOSITIONS)] + _phrase(rng)
    if rng.random() < 0.3:
        words.append(rng.choice(_ADVERBS))
    return words


def sentence_text(rng: random.Random, n_words: int) -> str:
    """Exactly `n_words` English-like words, made of sentences of clauses."""
    out: list[str] = []
    while len(out) < n_words:
        sentence = _clause(rng)
        while rng.random() < 0.35:
            sentence += [rng.choice(_CONNECTIVES)] + _clause(rng)
        sentence[0] = sentence[0].capitalize()
        sentence[-1] += rng.choice((".", ".", ".", "?", "!"))
        out += sentence
    out = out[:n_words]
    if out[-1][-1] not in ".?!":
        out[-1] += "."
    return " ".join(out)


@dataclass(frozen=True, slots=True)
class LengthMix:
    long_fraction: float = 0.2
    short_words: tuple[int, int] = (8, 24)
    long_words: tuple[int, int] = (100, 200)

    def describe(self) -> str:
        return (f"{100 - self.long_fraction * 100:.0f}% of {self.short_words[0]}-{self.short_words[1]} words, "
                f"{self.long_fraction * 100:.0f}% of {self.long_words[0]}-{self.long_words[1]} words")


SKEWED = LengthMix()


def skewed_texts(n: int, seed: int = 0, mix: LengthMix = SKEWED) -> list[str]:
    """`n` texts in a deterministic order; exactly round(n * long_fraction) of them are long,
    at positions drawn by the seed (so arrival order mixes short and long texts)."""
    rng = random.Random(seed)
    n_long = round(n * mix.long_fraction)
    is_long = [True] * n_long + [False] * (n - n_long)
    rng.shuffle(is_long)
    texts = []
    for long in is_long:
        lo, hi = mix.long_words if long else mix.short_words
        texts.append(sentence_text(rng, rng.randint(lo, hi)))
    return texts
