"""Two ranks (torchrun, gloo) that gather a metrics dict with ``all_gather_object`` and
broadcast a setting with ``broadcast_object_list`` every step: the pickled note grows
with the step (``$STEPS``, default 3), so the bytes moved differ from step to step;
with ``$EXTRA`` set every rank gathers once more in step 1."""

import io
import os

import torch
import torch.distributed as dist

try:
    import numpy  # noqa: F401  (torch's _tensor_to_object needs it)
except ImportError:  # the same, without numpy

    def _tensor_to_object(tensor, tensor_size, group):
        data = bytes(tensor.cpu().tolist())[:tensor_size]
        return dist.distributed_c10d._unpickler(io.BytesIO(data)).load()

    dist.distributed_c10d._tensor_to_object = _tensor_to_object


def report(loss, rank, step):
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"rank": rank, "loss": round(loss, 3), "note": "x" * step})
    setting = [{"lr": 0.1, "step": step}] if rank == 0 else [None]
    dist.broadcast_object_list(setting, src=0)
    if os.environ.get("EXTRA") and step == 1:
        dist.all_gather_object(gathered, {"again": step})
    return gathered


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(int(os.environ.get("STEPS", "3"))):
        loss = model(torch.randn(4, 8)).relu().sum()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad()
        report(float(loss.detach()), rank, step)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
