"""The committed generated code is exactly what the .proto files produce."""

from __future__ import annotations

from kvserve.proto import codegen


def test_generated_code_is_up_to_date() -> None:
    assert codegen.main(["--check"]) == 0, "run: python -m kvserve.proto.codegen"


def test_every_proto_has_its_generated_modules() -> None:
    names = {path.stem for path in codegen.proto_files()}
    generated = set(codegen.generate(codegen.PROTO_DIR))
    assert generated == {f"{n}{suffix}" for n in names for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")}
