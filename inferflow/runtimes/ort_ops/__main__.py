"""``python -m inferflow.runtimes.ort_ops [info | build | fetch-headers]``

- ``info`` (default): where the headers and the library are (nothing fetched or built);
- ``build``: fetch the headers if needed and build (or reuse) the library, then load it;
- ``fetch-headers``: only the headers.
Exit status 1 when the asked-for step is unavailable, with the reason on stderr.
"""

from __future__ import annotations

import argparse
import sys

from inferflow.runtimes.ort_ops import build, headers


def info() -> int:
    found = headers.find_headers()
    print(f"headers: {found or 'not found'} (searched $INFERFLOW_ORT_INCLUDE, /usr/include/onnxruntime, "
          f"{headers.fetched_dir()})")
    if found is not None:
        print(f"header C API version: {headers.api_version(found)}")
    if reason := build.disabled_reason():
        print(f"op: {reason}")
    try:
        command = build.compiler()
        print(f"compiler: {' '.join(command)} ({build.compiler_version(tuple(command))})")
        if found is not None:
            key = build.library_key(build.build_fields(found, command))
            entry = build.default_engine_dir() / "ops" / key / build.LIBRARY
            print(f"library: {entry} ({'built' if entry.is_file() else 'not built yet'})")
            if entry.is_file():
                print(f"kernels: {build.check_loads(entry)}")
    except build.OpUnavailable as exc:
        print(f"compiler: {exc}")
    print(f"cpu flags: {' '.join(build.cpu_flags()) or 'none of ' + ' '.join(build.CPU_FLAGS)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m inferflow.runtimes.ort_ops",
                                     description="inferflow's ONNX Runtime custom ops")
    parser.add_argument("command", nargs="?", default="info", choices=["info", "build", "fetch-headers"])
    args = parser.parse_args(argv)
    if args.command == "info":
        return info()
    try:
        if args.command == "fetch-headers":
            print(headers.ensure_headers(fetch=True))
            return 0
        built = build.build_library()
        isa = build.check_loads(built.path)
        verb = "reused" if built.reused else f"built in {built.build_seconds:.1f}s"
        print(f"{built.path} ({verb}; kernels: {isa})")
        return 0
    except (headers.HeadersUnavailable, build.OpUnavailable) as exc:
        print(f"unavailable: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
