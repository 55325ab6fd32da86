"""Data shipped inside the package, so that a wheel install has it too."""
from pathlib import Path

# The trained tiny AsyncT (scripts/train_tiny.py): `asynct demo`'s and `asynct eval`'s default
# model. In a source checkout `models/tiny-gsm` links here.
SHIPPED_MODEL = Path(__file__).resolve().parent / "tiny-gsm"
