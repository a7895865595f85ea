"""The seccomp filter of the local backend's judged commands: the kernel's key management calls
(``add_key``, ``request_key``, ``keyctl``) fail with EPERM, as Docker's default profile makes
them fail in a container; every other call is allowed.

The kernel keyring is state no namespace bubblewrap makes can separate: every process of one
uid reaches that uid's user keyring, across sandboxes, and its keys outlive them. Round 41: the
two runs of one grading ran as the same judged user, and the ordinary run, which holds the
tests as written, handed the judged run their expected values through it. A judged command
installs the filter as the last step before it becomes the command (``local_backend``'s
``_BECOME_JUDGED``): it cannot be removed, and every child inherits it.

    program = keyring_filter("x86_64")   # bytes: classic BPF, one 8-byte instruction each
"""

from __future__ import annotations

import struct

_LD_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS: a word of struct seccomp_data
_JEQ = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_AND = 0x54  # BPF_ALU | BPF_AND | BPF_K
_RET = 0x06  # BPF_RET | BPF_K
_NR, _ARCH = 0, 4  # offsets in struct seccomp_data
ALLOW = 0x7FFF0000  # SECCOMP_RET_ALLOW
DENY = 0x00050000 | 1  # SECCOMP_RET_ERRNO | EPERM

#: The host's machine -> per ABI it can run: (AUDIT_ARCH_*, a mask for the call number, the
#: numbers of add_key, request_key and keyctl). x86_64's mask folds x32 calls (bit 30) onto
#: theirs; the compat ABIs (i386, 32-bit ARM) have numbers of their own.
KEYRING_CALLS: dict[str, list[tuple[int, int | None, tuple[int, ...]]]] = {
    "x86_64": [(0xC000003E, 0xBFFFFFFF, (248, 249, 250)), (0x40000003, None, (286, 287, 288))],
    "aarch64": [(0xC00000B7, None, (217, 218, 219)), (0x40000028, None, (309, 310, 311))],
}


def keyring_filter(machine: str) -> bytes:
    """The filter for ``machine`` (``os.uname().machine``) as the bytes of its instructions.
    ValueError for a machine whose call numbers are not known here."""
    abis = KEYRING_CALLS.get(machine)
    if abis is None:
        known = ", ".join(sorted(KEYRING_CALLS))
        raise ValueError(f"no keyring filter for machine {machine!r} (known: {known})")
    prog: list[tuple[int, int | str, int, int]] = [(_LD_ABS, 0, 0, _ARCH)]
    for arch, mask, numbers in abis:
        block: list[tuple[int, int | str, int, int]] = [(_LD_ABS, 0, 0, _NR)]
        if mask is not None:
            block.append((_AND, 0, 0, mask))
        block += [(_JEQ, "deny", 0, n) for n in numbers]
        block.append((_RET, 0, 0, ALLOW))
        prog.append((_JEQ, 0, len(block), arch))  # another ABI: on to the next test
        prog += block
    prog.append((_RET, 0, 0, ALLOW))
    deny = len(prog)
    prog.append((_RET, 0, 0, DENY))
    out = bytearray()
    for i, (code, jt, jf, k) in enumerate(prog):
        offset = deny - (i + 1) if jt == "deny" else jt
        assert isinstance(offset, int) and 0 <= offset < 256
        out += struct.pack("=HBBI", code, offset, jf, k)
    return bytes(out)
