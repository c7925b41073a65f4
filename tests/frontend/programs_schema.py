"""Constants shared by the frontend programs (sglang venv) and their checks (kvflow venv)."""

SHARED = "Here are some facts about the city of Lyon in France. " * 6
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Lyon"]},
        "population": {"type": "integer", "minimum": 0, "maximum": 10000000},
    },
    "required": ["city", "population"],
    "additionalProperties": False,
}
CITY_QUESTION = "Q: What is the capital of France?\nA: The capital of France is"
CITIES = [" Paris.", " Berlin.", " a large city in Europe."]
