"""Rewrite a .cu source into C++ the CUDA emulator (cuda_emu.hpp) compiles.

Each launch ``kernel<T>  <<<grid, block, shmem, stream>>>(args)`` becomes

    ::emu::Launch("kernel", SYNC, grid, block, shmem, stream)
        .run([](const auto&... a) { kernel<T>(a...); }, args)

where SYNC says whether the kernel's body contains ``__syncthreads`` (its
threads then run as fibers with a real barrier; otherwise as plain calls). The
arguments are evaluated at the launch, as CUDA does. Line numbers are kept
(a ``#line`` directive names the original file), so compiler messages and the
emulator's aborts point into the .cu file. The original file is never written.

Usage: python translate.py SRC.cu OUT.cpp
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_:]*$")


def _match(src: str, i: int, open_c: str, close_c: str) -> int:
    """Index just past the bracket matching the one at src[i] (skips strings and comments)."""
    assert src[i] == open_c, (src[i], i)
    depth, j, n = 0, i, len(src)
    while j < n:
        c = src[j]
        if c in "\"'":
            q = c
            j += 1
            while j < n and src[j] != q:
                j += 2 if src[j] == "\\" else 1
        elif src.startswith("//", j):
            j = src.index("\n", j)
            continue
        elif src.startswith("/*", j):
            j = src.index("*/", j) + 2
            continue
        elif c == open_c:
            depth += 1
        elif c == close_c:
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    raise ValueError(f"unbalanced {open_c!r} at offset {i}")


def _strip_comments(src: str) -> str:
    """Comments replaced by spaces (offsets and newlines kept)."""
    out, j, n = [], 0, len(src)
    while j < n:
        if src.startswith("//", j):
            k = src.find("\n", j)
            k = n if k < 0 else k
            out.append(" " * (k - j))
            j = k
        elif src.startswith("/*", j):
            k = src.index("*/", j) + 2
            out.append("".join(ch if ch == "\n" else " " for ch in src[j:k]))
            j = k
        elif src[j] in "\"'":
            q, k = src[j], j + 1
            while k < n and src[k] != q:
                k += 2 if src[k] == "\\" else 1
            out.append(src[j : k + 1])
            j = k + 1
        else:
            out.append(src[j])
            j += 1
    return "".join(out)


def kernels_with_sync(code: str) -> dict:
    """{kernel name: whether its body calls __syncthreads} for every __global__ function."""
    out = {}
    for m in re.finditer(r"__global__\s+void\s+([A-Za-z_][A-Za-z0-9_]*)\s*\(", code):
        name = m.group(1)
        params_end = _match(code, m.end() - 1, "(", ")")
        brace = code.index("{", params_end)
        if ";" in code[params_end:brace]:
            continue  # a declaration
        body = code[brace : _match(code, brace, "{", "}")]
        out[name] = out.get(name, False) or "__syncthreads" in body
    if re.search(r"__device__[^;{]*\([^;{]*\)\s*\{[^}]*__syncthreads", code):
        # a device function synchronises: every kernel might reach it
        out = {k: True for k in out}
    return out


def _kernel_start(code: str, end: int) -> int:
    """Start of the kernel expression (name plus optional template arguments) ending at `end`."""
    j = end
    while j > 0 and code[j - 1].isspace():
        j -= 1
    if code[j - 1] == ">":  # template arguments: walk back to the matching '<'
        depth, k = 0, j - 1
        while k >= 0:
            if code[k] == ">":
                depth += 1
            elif code[k] == "<":
                depth -= 1
                if depth == 0:
                    break
            k -= 1
        j = k
        while j > 0 and code[j - 1].isspace():
            j -= 1
    m = re.search(r"[A-Za-z_][A-Za-z0-9_:]*$", code[:j])
    if not m:
        raise ValueError(f"no kernel name before <<< at offset {end}")
    return m.start()


def _find_config_end(code: str, i: int) -> int:
    """Index of the '>>>' closing the launch configuration that starts at i (paren depth 0)."""
    depth, j = 0, i
    while j < len(code):
        c = code[j]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif depth == 0 and code.startswith(">>>", j):
            return j
        j += 1
    raise ValueError(f"unclosed <<< at offset {i}")


def translate(src: str, filename: str) -> tuple:
    code = _strip_comments(src)
    sync = kernels_with_sync(code)
    out, pos, launches = [], 0, []
    for m in re.finditer(r"<<<", code):
        if m.start() < pos:
            continue
        k0 = _kernel_start(code, m.start())
        kernel = code[k0 : m.start()].strip()
        name = re.sub(r"\s*<.*$", "", kernel, flags=re.S)
        if name not in sync:
            raise ValueError(f"launch of {name!r}, which is not a __global__ function of this file")
        cfg_end = _find_config_end(code, m.end())
        cfg = code[m.end() : cfg_end]
        a = cfg_end + 3
        while code[a].isspace():
            a += 1
        if code[a] != "(":
            raise ValueError(f"no argument list after >>> for {name}")
        a_end = _match(code, a, "(", ")")
        args = code[a + 1 : a_end - 1]
        launches.append(name)
        out.append(src[pos:k0])
        call = (f'::emu::Launch("{name}", {"true" if sync[name] else "false"}, {cfg})'
                f".run([](const auto&... a) {{ {kernel}(a...); }}{', ' if args.strip() else ''}{args})")
        # keep the line count: newlines the call lost (around <<< and >>>) follow it
        extra = code[k0:a_end].count("\n") - call.count("\n")
        out.append(call + "\n" * max(extra, 0))
        pos = a_end
    out.append(src[pos:])
    text = f'#line 1 "{filename}"\n' + "".join(out)
    return text, launches, sync


def main(argv: list) -> int:
    src_path, out_path = Path(argv[1]), Path(argv[2])
    text, launches, sync = translate(src_path.read_text(), str(src_path))
    out_path.write_text(text)
    print(f"translate: {len(launches)} launches of {len(set(launches))} kernels; "
          f"with __syncthreads: {sorted(k for k, v in sync.items() if v)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
