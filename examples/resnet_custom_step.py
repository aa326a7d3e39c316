"""Your own step module in a layer-parallel ResNet, trained with Adam, checkpointed, exported.

    OMP_NUM_THREADS=1 mpiexec -n 2 python -m mpi4py examples/resnet_custom_step.py [--quick]

Each residual layer is ``x_{k+1} = x_k + h * F_k(x_k)`` with ``F_k`` the module below; MGRIT
solves all layers at once over the ranks (forward) and the adjoint gives the gradients
(backward). Any torch optimizer works on ``net.parameters()`` (this rank's parameters).
"""
import argparse
import os
import tempfile

import torch
from torch import nn

from data import load_dataset
from mgrit.nn import LayerParallelNet, LayerParallelResNet, ResidualStep
from mgrit.options import MGRITOptions
from mgrit.parallel import ProcessGrid
from mgrit.training import Trainer


class GatedStep(nn.Module):
    """F(x) = sigmoid(G x) * tanh(W x + b): any module mapping (batch, width) to the same shape."""

    def __init__(self, width):
        super().__init__()
        self.lin, self.gate = nn.Linear(width, width), nn.Linear(width, width, bias=False)

    def forward(self, x):
        return torch.sigmoid(self.gate(x)) * torch.tanh(self.lin(x))


p = argparse.ArgumentParser()
p.add_argument("--quick", action="store_true", help="a few seconds: 8 layers, 1 epoch on 320 images")
p.add_argument("--out", default=None, help="folder for checkpoint.pt and model.pt")
args = p.parse_args()
torch.set_default_dtype(torch.float64)       # exact mode: the solves reproduce serial backprop
grid = ProcessGrid()                         # all ranks split the layers (no data parallelism)
out = args.out or (tempfile.mkdtemp(prefix="layerpar-") if grid.comm.rank == 0 else None)
out = grid.comm.bcast(out)                   # rank 0's folder, on every rank
os.makedirs(out, exist_ok=True)
train, test = load_dataset("digits")         # 8x8 digit images, bundled (nothing downloaded)
width, layers, epochs = 16, 8 if args.quick else 32, 1 if args.quick else 5
exact = MGRITOptions(max_levels=2, cfactor=4, tol=1e-10, max_iter=50)  # inexact: tol=0, max_iter=2
resnet = LayerParallelResNet.build(lambda k: GatedStep(width), layers, (width,), T=1.0,
                                   comm=grid.layer_comm, forward=exact, backward=exact)
torch.manual_seed(0)
net = LayerParallelNet(nn.Sequential(nn.Flatten(), nn.Linear(64, width)), resnet, nn.Linear(width, 10))
opt = torch.optim.Adam(net.parameters(), lr=3e-3)
trainer = Trainer(net, opt, grid, checkpoint=os.path.join(out, "checkpoint.pt"))  # every epoch
data = (train.x[:320], train.y[:320]) if args.quick else train  # (x, y) arrays or a Split
result = trainer.fit(data, epochs=epochs, batch_size=64, seed=0, test=test)
if trainer.is_root:
    print(f"test loss before {result.plan.initial_test_loss:.4f} after {result.final['test_loss']:.4f}")

# Export: net.to_serial() is the equivalent plain nn.Sequential with the trained weights
# (opening, ResidualStep(F_k, h) = x + h F_k(x) per layer, closing); save its state_dict.
serial = net.to_serial()                      # collective; every rank gets the whole model
x = torch.as_tensor(test.x[:100], dtype=torch.float64)
with torch.no_grad():
    y_par = net.from_last(net(x))             # collective; the output lives on the last rank
if grid.comm.rank == 0:
    torch.save(serial.state_dict(), os.path.join(out, "model.pt"))
    # elsewhere, without MPI: the same architecture in plain PyTorch, then load the weights
    h = 1.0 / layers
    plain = nn.Sequential(nn.Sequential(nn.Flatten(), nn.Linear(64, width)),
                          *[ResidualStep(GatedStep(width), h) for _ in range(layers)],
                          nn.Linear(width, 10))
    plain.load_state_dict(torch.load(os.path.join(out, "model.pt"), weights_only=True))
    with torch.no_grad():
        print(f"exported model vs layer-parallel net: max |diff| {(plain(x) - y_par).abs().max():.2e}")
    print(f"checkpoint.pt and model.pt in {out}")
