"""Checks that built wheels install and load wherever PyTorch's manylinux_2_28 wheels do.

    python tools/check_wheel.py [--max-glibc 2.28] WHEEL...

For each wheel: every platform tag in its WHEEL file is manylinux and the lowest one asks
for glibc <= --max-glibc; every shared object in it needs no GLIBC_ symbol version above
that lowest tag, and links (DT_NEEDED) only libraries every glibc system has.  The CUDA
driver is loaded at run time, so libcuda must not appear there.  Prints what it found and
one line per problem; exits 1 if there is any.  `nox -s build` runs it on the wheel it makes.
"""

from __future__ import annotations

import argparse
import re
import struct
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

# Libraries that glibc itself (and the GCC runtime every manylinux system has) provide.
SYSTEM_LIBRARIES = frozenset(
    {
        "libc.so.6",
        "libm.so.6",
        "libdl.so.2",
        "libpthread.so.0",
        "librt.so.1",
        "libutil.so.1",
        "libgcc_s.so.1",
        "ld-linux-x86-64.so.2",
        "ld-linux-aarch64.so.1",
    }
)
# The legacy manylinux names and the glibc each stands for (PEP 600).
LEGACY_MANYLINUX = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}

SHT_DYNAMIC = 6
SHT_GNU_VERNEED = 0x6FFFFFFE
DT_NEEDED = 1


@dataclass
class ElfNeeds:
    """What a shared object asks of the system it is loaded on."""

    libraries: list[str] = field(default_factory=list)  # DT_NEEDED, in file order
    versions: set[str] = field(default_factory=set)  # e.g. {"GLIBC_2.17", "GCC_3.0"}


def _c_string(data: bytes, offset: int) -> str:
    return data[offset : data.index(b"\0", offset)].decode()


def elf_needs(data: bytes) -> ElfNeeds:
    """Reads DT_NEEDED and the symbol versions required from other objects (.gnu.version_r)
    from a 64-bit little-endian ELF file, the format of every Linux target PyTorch ships."""
    if data[:4] != b"\x7fELF":
        raise ValueError("not an ELF file")
    if data[4] != 2 or data[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    shoff, shentsize, shnum = (
        struct.unpack_from("<Q", data, 0x28)[0],
        *struct.unpack_from("<HH", data, 0x3A),
    )
    sections = []
    for i in range(shnum):
        _, sh_type, _, _, offset, size, link, info, _, _ = struct.unpack_from(
            "<IIQQQQIIQQ", data, shoff + i * shentsize
        )
        sections.append((sh_type, offset, size, link, info))

    needs = ElfNeeds()
    for sh_type, offset, size, link, info in sections:
        strings = sections[link][1]
        if sh_type == SHT_DYNAMIC:
            for entry in range(offset, offset + size, 16):
                tag, value = struct.unpack_from("<qQ", data, entry)
                if tag == DT_NEEDED:
                    needs.libraries.append(_c_string(data, strings + value))
        elif sh_type == SHT_GNU_VERNEED:
            need = offset
            for _ in range(info):  # sh_info: the number of Verneed entries
                _, count, _, aux_offset, next_need = struct.unpack_from("<HHIII", data, need)
                aux = need + aux_offset
                for _ in range(count):
                    _, _, _, name, next_aux = struct.unpack_from("<IHHII", data, aux)
                    needs.versions.add(_c_string(data, strings + name))
                    aux += next_aux
                need += next_need
    return needs


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


def glibc_of_platform_tag(tag: str) -> tuple[int, int] | None:
    """manylinux_2_28_x86_64 -> (2, 28); a legacy alias -> its glibc; anything else -> None."""
    match = re.fullmatch(r"manylinux_(\d+)_(\d+)_\w+", tag)
    if match:
        return int(match[1]), int(match[2])
    for legacy, glibc in LEGACY_MANYLINUX.items():
        if tag.startswith(legacy + "_"):
            return glibc
    return None


def wheel_platform_tags(wheel_text: str) -> list[str]:
    """The platform parts of every `Tag:` line of a WHEEL file (compressed sets expanded)."""
    tags = []
    for line in wheel_text.splitlines():
        if line.startswith("Tag:"):
            tags += line.split(":", 1)[1].strip().split("-")[-1].split(".")
    return tags


def check_wheel(path: Path, max_glibc: tuple[int, int]) -> tuple[list[str], list[str]]:
    """Returns (what was found, problems) for one wheel."""
    found, problems = [], []
    with zipfile.ZipFile(path) as wheel:
        names = wheel.namelist()
        wheel_files = [n for n in names if n.count("/") == 1 and n.endswith(".dist-info/WHEEL")]
        if len(wheel_files) != 1:
            return found, [f"expected one .dist-info/WHEEL file, found {len(wheel_files)}"]
        platforms = wheel_platform_tags(wheel.read(wheel_files[0]).decode())
        found.append("platform tags: " + (", ".join(platforms) or "none"))
        tag_glibcs = []
        for platform in platforms:
            glibc = glibc_of_platform_tag(platform)
            if glibc is None:
                problems.append(f"platform tag {platform} is not manylinux")
            else:
                tag_glibcs.append(glibc)
        if not platforms:
            problems.append("the WHEEL file has no Tag line")
        claimed = min(tag_glibcs, default=None)
        if claimed is not None and claimed > max_glibc:
            problems.append(
                f"the wheel asks for glibc {_dotted(claimed)}; the limit is {_dotted(max_glibc)}"
            )

        objects = [n for n in names if re.search(r"\.so(\.[\d.]+)?$", n)]
        if not objects:
            problems.append("no shared object in the wheel (the native module is missing)")
        for name in objects:
            try:
                needs = elf_needs(wheel.read(name))
            except (ValueError, struct.error, IndexError) as error:
                problems.append(f"{name}: cannot read it as ELF ({error})")
                continue
            glibc = [_version(v[6:]) for v in needs.versions if re.fullmatch(r"GLIBC_[\d.]+", v)]
            highest = max(glibc, default=None)
            shown = "none" if highest is None else _dotted(highest)
            found.append(f"{name}: needs {', '.join(needs.libraries)}; highest GLIBC {shown}")
            foreign = [lib for lib in needs.libraries if lib not in SYSTEM_LIBRARIES]
            if foreign:
                problems.append(f"{name} links libraries outside glibc: {', '.join(foreign)}")
            if "GLIBC_PRIVATE" in needs.versions:
                problems.append(f"{name} uses GLIBC_PRIVATE symbols")
            limit = min(claimed or max_glibc, max_glibc)
            if highest is not None and highest > limit:
                problems.append(f"{name} needs GLIBC {shown}, above the {_dotted(limit)} allowed")
    return found, problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("wheels", nargs="+", type=Path)
    parser.add_argument("--max-glibc", default="2.28", help="highest glibc allowed (2.28)")
    args = parser.parse_args(argv)
    max_glibc = _version(args.max_glibc)
    if len(max_glibc) != 2:
        parser.error("--max-glibc takes MAJOR.MINOR, e.g. 2.28")
    failed = False
    for path in args.wheels:
        found, problems = check_wheel(path, max_glibc)
        print(path.name)
        for line in found:
            print("  " + line)
        for line in problems:
            print("  PROBLEM: " + line)
        failed |= bool(problems)
    print("FAILED" if failed else f"OK: glibc <= {_dotted(max_glibc)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
