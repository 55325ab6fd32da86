"""Local lm-eval tasks shipped with asynct (load with `TaskManager(include_path=TASKS_DIR)`)."""
from pathlib import Path

TASKS_DIR = Path(__file__).resolve().parent
