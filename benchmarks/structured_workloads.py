"""The workloads of `shoal bench structured` (structured.py runs them):
two JSON schemas and the chat prompts that ask for them. Pure Python.

Every string is bounded (maxLength, enum, pattern) so that each reply closes
within its token cap whatever the model writes; a tag renames one property,
so that each tag makes a schema of its own (a cache miss, for compile times).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

CITIES = (
    "Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Sydney", "Denver", "Nairobi",
    "Madrid", "Hanoi", "Quebec", "Dublin", "Seoul", "Zurich", "Austin", "Porto",
)  # fmt: skip
PRODUCTS = (
    "kettle", "bicycle", "desk lamp", "backpack", "guitar", "tent", "drone", "blender",
    "camera", "sofa", "watch", "scooter", "printer", "jacket", "telescope", "keyboard",
)  # fmt: skip


def tool_call_schema(tag: str = "") -> dict:
    """A get_weather tool's arguments, as an OpenAI tools request gives them.
    Strings are bounded so that every reply ends inside max_tokens."""
    return {
        "type": "object",
        "properties": {
            "location" + tag: {"type": "string", "maxLength": 32, "description": "City and country"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 14},
            "include_hourly": {"type": "boolean"},
        },
        "required": ["location" + tag, "unit", "days", "include_hourly"],
        "additionalProperties": False,
    }


def record_schema(tag: str = "") -> dict:
    """30 properties of every kind, two of them arrays of objects that hold arrays."""
    text, word = {"type": "string", "maxLength": 16}, {"type": "string", "maxLength": 10}
    props: dict = {
        "name" + tag: text,
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "brand": text,
        "category": {"enum": ["home", "sport", "music", "office", "outdoor", "tech"]},
        "price": {"type": "number", "minimum": 0, "maximum": 10000},
        "currency": {"enum": ["USD", "EUR", "JPY"]},
        "in_stock": {"type": "boolean"},
        "stock_count": {"type": "integer", "minimum": 0, "maximum": 9999},
        "rating": {"type": "number", "minimum": 0, "maximum": 5},
        "reviews": {"type": "integer", "minimum": 0, "maximum": 99999},
        "color": word,
        "material": word,
        "weight_kg": {"type": "number", "minimum": 0, "maximum": 500},
        "width_cm": {"type": "integer", "minimum": 0, "maximum": 1000},
        "height_cm": {"type": "integer", "minimum": 0, "maximum": 1000},
        "depth_cm": {"type": "integer", "minimum": 0, "maximum": 1000},
        "warranty_years": {"type": "integer", "minimum": 0, "maximum": 10},
        "origin": word,
        "tags": {"type": "array", "items": word, "minItems": 1, "maxItems": 3},
        "features": {"type": "array", "items": text, "minItems": 1, "maxItems": 3},
        "variants": {
            "type": "array",
            "minItems": 1,
            "maxItems": 2,
            "items": {
                "type": "object",
                "properties": {
                    "label": word,
                    "sizes": {"type": "array", "items": {"enum": ["S", "M", "L", "XL"]}, "minItems": 1, "maxItems": 3},
                },
                "required": ["label", "sizes"],
                "additionalProperties": False,
            },
        },
        "discount": {"anyOf": [{"type": "null"}, {"type": "number", "minimum": 0, "maximum": 90}]},
        "release_year": {"type": "integer", "minimum": 1990, "maximum": 2030},
        "eco_friendly": {"type": "boolean"},
        "energy_class": {"enum": ["A", "B", "C", "D"]},
        "seller": {
            "type": "object",
            "properties": {
                "name": word,
                "country": word,
                "ratings": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 5}, "maxItems": 3},
            },
            "required": ["name", "country", "ratings"],
            "additionalProperties": False,
        },
        "shipping_days": {"type": "integer", "minimum": 0, "maximum": 60},
        "returnable": {"type": "boolean"},
        "language": {"enum": ["en", "fr", "de", "ja"]},
        "summary": {"type": "string", "maxLength": 24},
    }  # fmt: skip
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


@dataclass(frozen=True)
class Workload:
    name: str
    schema: Callable[[str], dict]  # a property-name tag -> the schema
    max_tokens: int  # enough for every reply to close its JSON

    def prompts(self, tokenizer, n: int) -> list[str]:
        if self.name == "tool call":
            asks = [f"What's the weather in {CITIES[i % 16]} for the next {1 + i // 16} days?" for i in range(n)]
            system = "Call get_weather: reply with its arguments as one JSON object."
        else:
            asks = [f"Describe the {PRODUCTS[i % 16]} number {i} we sell." for i in range(n)]
            system = "Reply with the product record as one JSON object."
        return [
            tokenizer.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": a}])
            if tokenizer.chat_template
            else f"{system}\n{a}\n"
            for a in asks
        ]


WORKLOADS = (Workload("tool call", tool_call_schema, 64), Workload("30 properties", record_schema, 448))
