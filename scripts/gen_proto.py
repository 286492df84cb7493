"""Generate the Python stubs of proto/vtm/v1/vtm.proto into src/vtm/proto/.

    .venv/bin/python scripts/gen_proto.py [--out FOLDER]

The stubs are checked in (an installed wheel imports them without
grpcio-tools); tests/vtm/test_broker.py regenerates them into a temporary
folder and fails when they differ. The proto is mapped to the virtual path
vtm/proto/vtm/v1/vtm.proto so the generated modules import each other as
vtm.proto.vtm.v1, inside the vtm package.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
SRC = ROOT / "src"  # the packages' folder; GENERATED is relative to it
PROTO = "proto/vtm/v1/vtm.proto"
GENERATED = ["vtm/proto/vtm/v1/vtm_pb2.py", "vtm/proto/vtm/v1/vtm_pb2.pyi", "vtm/proto/vtm/v1/vtm_pb2_grpc.py"]


def generate(out: pathlib.Path) -> None:
    from grpc_tools import protoc

    out.mkdir(parents=True, exist_ok=True)
    rc = protoc.main(["protoc", f"-Ivtm/proto={ROOT / 'proto'}", f"--python_out={out}", f"--pyi_out={out}",
                      f"--grpc_python_out={out}", str(ROOT / PROTO)])
    if rc != 0:
        raise RuntimeError(f"protoc failed with status {rc}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=SRC, help="folder to write vtm/proto/... under")
    generate(parser.parse_args().out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
