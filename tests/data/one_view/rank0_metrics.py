"""Two ranks (torchrun, gloo) whose ``metrics`` does more on rank 0 than on rank 1,
as training scripts log on rank 0: ``$EXTRA`` (default 1) scales rank 0's extra work,
0 removes it; ``$SKIP_READ`` names a rank that stops reading the loss (the others go
on); ``$STEPS`` the steps (default 3)."""

import os

import torch
import torch.distributed as dist


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x).relu().sum()


def metrics(loss, rank):
    value = loss.detach()
    if rank == 0:  # rank 0 logs more than the others
        extra = int(os.environ.get("EXTRA", "1"))
        for _ in range(4 * extra):
            value = value.exp().log()
    if rank == int(os.environ.get("SKIP_READ", "-1")):
        return None
    return float(value)


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _step in range(int(os.environ.get("STEPS", "3"))):
        loss = model(torch.randn(4, 8))
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad()
        metrics(loss, rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
