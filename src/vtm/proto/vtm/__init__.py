"""Generated gRPC stubs of proto/vtm/v1/vtm.proto (scripts/gen_proto.py)."""
