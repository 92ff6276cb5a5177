"""Generated JSON schemas for structured-output tests and benchmarks: nested objects, arrays, enums, bounded
integers and numbers, required and optional fields. Deterministic (seeded), and small enough that a small model's
answer fits in a few dozen tokens: strings and arrays are bounded."""

from __future__ import annotations

import random

WORDS = ["red", "green", "blue", "cat", "dog", "sun", "moon", "tree"]


def _leaf(rng: random.Random) -> dict:
    kind = rng.choice(["integer", "number", "enum", "boolean", "string", "array"])
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(1, 100)}
    if kind == "number":
        lo = rng.randint(-10, 10)
        return {"type": "number", "minimum": lo, "maximum": lo + rng.randint(1, 20)}
    if kind == "enum":
        return {"enum": rng.sample(WORDS, rng.randint(2, 4))}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "string":
        return {"type": "string", "minLength": 1, "maxLength": rng.randint(2, 6)}
    return {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1,
            "maxItems": rng.randint(1, 3)}


def _object(rng: random.Random, depth: int) -> dict:
    # Nested objects hold at most two fields and nest once: an answer stays within a few dozen tokens.
    names = rng.sample(["id", "name", "color", "size", "ok", "tags", "pos", "info", "count"],
                       rng.randint(1, 3 if depth == 0 else 2))
    props = {n: (_object(rng, depth + 1) if depth == 0 and rng.random() < 0.3 else _leaf(rng)) for n in names}
    required = [n for n in names if rng.random() < 0.8] or names[:1]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def generated_schemas(count: int = 50, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [_object(rng, 0) for _ in range(count)]
