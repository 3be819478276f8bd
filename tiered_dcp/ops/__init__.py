"""Operations on saved steps: export, import of stock DCP checkpoints, verify."""
