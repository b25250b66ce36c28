"""The batch a worker script's rank trains on at `step` (imported by the scripts beside it, run by torchrun)."""
import torch


def rank_batch(step: int, rank: int) -> dict:
    """Two rows of tasks 0 and 1, drawn for this step and rank (each rank its own rows); then seeds torch with the
    step, so engines trained side by side draw the same dropout masks."""
    g = torch.Generator().manual_seed(100 * step + rank)
    batch = dict(input_ids=torch.randint(3, 200, (2, 9), generator=g),
                 labels=torch.randint(3, 200, (2, 4), generator=g), task_ids=torch.tensor([0, 1]))
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    torch.manual_seed(step)
    return batch
