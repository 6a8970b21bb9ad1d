"""Hand-made hostile pickles: each is written opcode by opcode, so it really holds the opcode
and the protocol it is named after (``pickle.dumps`` would pick its own), and each one, read by a
full unpickler, runs ``touch <sentinel>`` through ``os.system``. The tests check that nothing
in the project's readers lets one run."""
from __future__ import annotations

import pickletools
from typing import Callable

# how os.system is reached: DCP's metadata module imports os, and protocol 4+ follows dotted names
META = "torch.distributed.checkpoint.metadata"
DOTTED = (META, "os.system")
PLAIN = ("posix", "system")  # os.system's own home on Linux: a global no allow-list should hold


def _header(proto: int) -> bytes:
    return bytes([0x80, proto]) if proto >= 2 else b""


def _text(proto: int, s: str) -> bytes:
    raw = s.encode()
    if proto == 0:
        return b"V" + raw + b"\n"  # UNICODE
    return b"X" + len(raw).to_bytes(4, "little") + raw  # BINUNICODE


def _tuple1(proto: int, item: bytes) -> bytes:
    return item + b"\x85" if proto >= 2 else b"(" + item + b"t"  # TUPLE1 / MARK .. TUPLE


def global_op(module: str, name: str) -> bytes:
    """GLOBAL (any protocol): the module and name as text lines."""
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def stack_global_op(proto: int, module: str, name: str) -> bytes:
    """STACK_GLOBAL (protocol 4+): module and name pushed as strings first."""
    return _text(proto, module) + _text(proto, name) + b"\x93"


def reduce_call(proto: int, callable_op: bytes, command: str) -> bytes:
    """``callable(command)`` by REDUCE."""
    return callable_op + _tuple1(proto, _text(proto, command)) + b"R"


def finish(proto: int, body: bytes) -> bytes:
    return _header(proto) + body + b"."


def command(sentinel: str) -> str:
    return f"touch {sentinel}"


# name -> builder(sentinel) of the pickle's bytes
def cases() -> dict[str, Callable[[str], bytes]]:
    out: dict[str, Callable[[str], bytes]] = {}
    for proto in range(6):
        out[f"p{proto}-GLOBAL-dotted"] = lambda s, p=proto: finish(p, reduce_call(p, global_op(*DOTTED), command(s)))
        out[f"p{proto}-GLOBAL-posix.system"] = lambda s, p=proto: finish(
            p, reduce_call(p, global_op(*PLAIN), command(s))
        )
        # the os module itself, a plain (undotted) attribute of an allowed module
        out[f"p{proto}-GLOBAL-module-attribute"] = lambda s, p=proto: finish(p, global_op(META, "os"))
        # INST: MARK args INST module name -> module.name(*args)
        out[f"p{proto}-INST-dotted"] = lambda s, p=proto: finish(
            p, b"(" + _text(p, command(s)) + b"i" + DOTTED[0].encode() + b"\n" + DOTTED[1].encode() + b"\n")
        # an allowed class called with an argument that itself would run the command
        out[f"p{proto}-REDUCE-allowed-class-hostile-argument"] = lambda s, p=proto: finish(
            p, global_op("torch", "Size") + _tuple1(p, reduce_call(p, global_op(*PLAIN), command(s))) + b"R")
    for proto in range(1, 6):
        # OBJ: MARK class args OBJ -> class(*args)
        out[f"p{proto}-OBJ-dotted"] = lambda s, p=proto: finish(
            p, b"(" + global_op(*DOTTED) + _text(p, command(s)) + b"o"
        )
    for proto in range(2, 6):
        # NEWOBJ on an allowed class whose argument would run the command
        out[f"p{proto}-NEWOBJ-allowed-class-hostile-argument"] = lambda s, p=proto: finish(
            p, global_op("torch", "Size") + _tuple1(p, reduce_call(p, global_op(*PLAIN), command(s))) + b"\x81")
        # BUILD: an allowed class's state taken from the command's result
        out[f"p{proto}-BUILD-allowed-class-hostile-state"] = lambda s, p=proto: finish(
            p, global_op(META, "StorageMeta") + b")\x81" + reduce_call(p, global_op(*PLAIN), command(s)) + b"b")
    for proto in (4, 5):
        out[f"p{proto}-STACK_GLOBAL-dotted"] = lambda s, p=proto: finish(
            p, reduce_call(p, stack_global_op(p, *DOTTED), command(s)))
        out[f"p{proto}-STACK_GLOBAL-posix.system"] = lambda s, p=proto: finish(
            p, reduce_call(p, stack_global_op(p, *PLAIN), command(s)))
    return out


def opcodes(data: bytes) -> list[str]:
    """The opcode names in ``data``, in order (pickletools' disassembly, which runs nothing)."""
    return [op.name for op, _, _ in pickletools.genops(data)]


def protocol(data: bytes) -> int:
    """The protocol a pickle declares (PROTO opcode), 0 without one."""
    for op, arg, _ in pickletools.genops(data):
        if op.name == "PROTO":
            return int(arg)
    return 0
