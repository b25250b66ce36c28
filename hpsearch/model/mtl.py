"""MTL: one T5 fine-tuned on all tasks, the task named in the input text; no task-specific parameters."""
from hpsearch.model.base import MultiTaskT5


class MultiTaskBaseline(MultiTaskT5):
    """Plain multi-task T5. `task_ids` are accepted (and ignored) so every method shares one interface."""
