"""Test helper: apply {"a.b.c": value} overrides to a nested config dict (the test configs' shorthand)."""


def set_dotted(data: dict, overrides: dict) -> dict:
    for key, value in overrides.items():
        node = data
        *path, last = key.split(".")
        for k in path:
            node = node.setdefault(k, {})
        node[last] = value
    return data
