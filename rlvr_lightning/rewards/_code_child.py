# The per-case harness of ``rewards/code.py``: run by the runner (``_code_runner.py``) with
# ``exec`` in each test case's forked, locked-down child (never imported). Descriptor 3 is its
# only channel: the first line is the solution, each later line one step of the test, and each
# answer is a line back. The model code runs in this process and may rewrite all of it; that
# is why answers carry values (the expected ones stay with the trainer), never pass flags.
import json
import os
import sys

MAX_DEPTH = 64
SEQUENCES = (("l", list), ("t", tuple), ("e", set), ("z", frozenset))


def encode(value, depth=0):
    # Plain data only: a result's own __eq__ or __repr__ never reaches the trainer.
    if depth > MAX_DEPTH:
        raise ValueError("value nested too deeply")
    if value is None:
        return ["n"]
    if isinstance(value, bool):
        return ["b", bool(value)]
    if isinstance(value, int):
        return ["i", int.__repr__(value)]
    if isinstance(value, float):
        return ["f", float.__repr__(value)]
    if isinstance(value, complex):
        return ["c", [float.__repr__(value.real), float.__repr__(value.imag)]]
    if isinstance(value, str):
        return ["s", str.__str__(value)]
    if isinstance(value, (bytes, bytearray)):
        return ["y", bytes(value).hex()]
    for tag, kind in SEQUENCES:
        if isinstance(value, kind):
            return [tag, [encode(item, depth + 1) for item in value]]
    if isinstance(value, dict):
        return ["d", [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]]
    return ["?", type(value).__name__]


def answer(step, scope):
    if step["kind"] == "exec":
        exec(compile(step["src"], "test.py", "exec"), scope)
        return {"id": step["id"], "done": True}
    value = eval(compile(step["src"], "test.py", "eval"), scope)
    if step["kind"] == "truth":
        return {"id": step["id"], "value": ["b", bool(value)]}
    return {"id": step["id"], "value": encode(value)}


def reply(message):
    data = json.dumps(message).encode() + b"\n"
    while data:
        data = data[os.write(3, data) :]


def main():
    sys.stdin, sys.stdout = open(0, closefd=False), open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False)
    channel = open(3, "rb", closefd=False)
    first = json.loads(channel.readline())
    scope = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(compile(first["code"], "solution.py", "exec"), scope)
    except SystemExit as exc:
        if not first["io"] or exc.code not in (None, 0):
            raise
    sys.stdout.flush()
    if first["io"]:
        return
    for line in channel:
        step = json.loads(line)
        try:
            message = answer(step, scope)
        except BaseException as exc:
            reply({"id": step["id"], "error": type(exc).__name__})
            raise
        reply(message)


main()
