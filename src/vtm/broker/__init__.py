"""The vtm broker (vtmd) and its client, vtm.connect (docs/broker.md)."""
