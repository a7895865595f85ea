"""The seccomp filter of every command the local backend runs with the agent's or the patch's
code (an agent's, a judged one's; root's own grading steps run neither): what Docker's default profile refuses a process without capabilities, and
which would reach kernel state beyond the sandbox, is refused here too; every other call is
allowed.

- **The kernel keyring** (``add_key``, ``request_key``, ``keyctl``: EPERM). No namespace
  bubblewrap makes can separate it: every process of one uid reaches that uid's user keyring,
  across sandboxes, and its keys outlive them. Round 41: the two runs of one grading ran as the
  same judged user, and the ordinary run, which holds the tests as written, handed the judged
  run their expected values through it. Round 71: an agent's command, whose root is the host's
  root, wrote keys into the host root's keyring that the host and later sandboxes listed.
- **New user namespaces** (``unshare`` and ``clone`` with ``CLONE_NEWUSER``: EPERM; ``clone3``,
  whose flags a filter cannot read: ENOSYS, so that the C library falls back to ``clone``).
  Inside one, the judged user holds every capability over namespaces of its own: it can mount,
  and make network, mount and IPC namespaces, each a way into more of the kernel (round 67:
  a judged command made user, network and mount namespaces and mounted a tmpfs on the local
  backend; Docker's profile refused it). Without one, making any other namespace takes
  ``CAP_SYS_ADMIN``, which the judged user does not have.

A judged command installs the filter as the last step before it becomes the command
(``local_backend``'s ``_BECOME_JUDGED``), and so does an agent's command run by root;
run by another user, bubblewrap installs it (``--seccomp``) after it made the sandbox's user
namespace. It cannot be removed, and every child
inherits it.

    program = command_filter("x86_64")   # bytes: classic BPF, one 8-byte instruction each
"""

from __future__ import annotations

import struct
from typing import NamedTuple

_LD_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS: a word of struct seccomp_data
_JEQ = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_JSET = 0x45  # BPF_JMP | BPF_JSET | BPF_K
_AND = 0x54  # BPF_ALU | BPF_AND | BPF_K
_RET = 0x06  # BPF_RET | BPF_K
_NR, _ARCH, _ARG0 = 0, 4, 16  # offsets in struct seccomp_data (arg 0's low word, little-endian)
ALLOW = 0x7FFF0000  # SECCOMP_RET_ALLOW
DENY = 0x00050000 | 1  # SECCOMP_RET_ERRNO | EPERM
NOSYS = 0x00050000 | 38  # SECCOMP_RET_ERRNO | ENOSYS
CLONE_NEWUSER = 0x10000000


class Abi(NamedTuple):
    """One ABI a machine runs: its AUDIT_ARCH_*, a mask for the call number (x86_64's folds
    x32 calls, bit 30, onto theirs), and its call numbers."""

    arch: int
    mask: int | None
    keyring: tuple[int, ...]  # add_key, request_key, keyctl
    unshare: int
    clone: int
    clone3: int


#: The host's machine -> the ABIs it can run (the compat ABIs, i386 and 32-bit ARM, have numbers
#: of their own).
ABIS: dict[str, list[Abi]] = {
    "x86_64": [
        Abi(0xC000003E, 0xBFFFFFFF, (248, 249, 250), unshare=272, clone=56, clone3=435),
        Abi(0x40000003, None, (286, 287, 288), unshare=310, clone=120, clone3=435),
    ],
    "aarch64": [
        Abi(0xC00000B7, None, (217, 218, 219), unshare=97, clone=220, clone3=435),
        Abi(0x40000028, None, (309, 310, 311), unshare=337, clone=120, clone3=435),
    ],
}

_Insn = tuple[int, "int | str", "int | str", int]  # code, jump if true, jump if false, k


def command_filter(machine: str) -> bytes:
    """The filter for ``machine`` (``os.uname().machine``) as the bytes of its instructions.
    ValueError for a machine whose call numbers are not known here."""
    abis = ABIS.get(machine)
    if abis is None:
        known = ", ".join(sorted(ABIS))
        raise ValueError(f"no seccomp filter for machine {machine!r} (known: {known})")
    prog: list[_Insn | str] = [(_LD_ABS, 0, 0, _ARCH)]
    for i, abi in enumerate(abis):
        prog.append((_JEQ, 0, f"abi{i + 1}", abi.arch))  # another ABI: on to the next test
        prog.append((_LD_ABS, 0, 0, _NR))
        if abi.mask is not None:
            prog.append((_AND, 0, 0, abi.mask))
        prog += [(_JEQ, "deny", 0, n) for n in abi.keyring]
        prog.append((_JEQ, "nosys", 0, abi.clone3))
        prog.append((_JEQ, "flags", 0, abi.unshare))
        prog.append((_JEQ, "flags", "allow", abi.clone))
        prog.append(f"abi{i + 1}")
    prog += [
        "allow",
        (_RET, 0, 0, ALLOW),
        "flags",  # unshare / clone: refused when their flags make a user namespace
        (_LD_ABS, 0, 0, _ARG0),
        (_JSET, "deny", 0, CLONE_NEWUSER),
        (_RET, 0, 0, ALLOW),
        "deny",
        (_RET, 0, 0, DENY),
        "nosys",
        (_RET, 0, 0, NOSYS),
    ]
    return _assemble(prog)


def _assemble(prog: list[_Insn | str]) -> bytes:
    """Classic BPF from instructions and labels (a label names the next instruction; a jump
    names a label or gives its offset, and goes forward only)."""
    labels: dict[str, int] = {}
    insns: list[_Insn] = []
    for item in prog:
        if isinstance(item, str):
            labels[item] = len(insns)
        else:
            insns.append(item)
    out = bytearray()
    for i, (code, jt, jf, k) in enumerate(insns):
        jumps = [labels[j] - (i + 1) if isinstance(j, str) else j for j in (jt, jf)]
        assert all(0 <= j < 256 for j in jumps), (i, jumps)
        out += struct.pack("=HBBI", code, jumps[0], jumps[1], k)
    return bytes(out)
