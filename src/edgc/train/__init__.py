"""Training machinery: local launch, trainer loop, checkpoints, metrics."""
