"""A checkpoint whose bytes changed after it was written is refused (issue 25: corrupted data
is an error): torch's zip reader does not verify the tensors' bytes, the file's SHA-256 digest
of its contents does (mgrit/training/checkpoint/io.py)."""
import torch

from mgrit.training.checkpoint.io import FORMAT, read_file, write_atomic


def _ckpt():
    g = torch.Generator().manual_seed(0)
    return {"format": FORMAT, "model": {"0.weight": torch.randn(64, 64, generator=g,
                                                                dtype=torch.float64)},
            "optimizer": {"state": {0: {"momentum_buffer": torch.ones(64, dtype=torch.float64)}},
                          "param_groups": [{"lr": 0.1, "params": [0]}]},
            "epoch": 3, "note": "x"}


def test_flipped_tensor_bytes_are_an_error_naming_the_file(tmp_path):
    path = str(tmp_path / "c.pt")
    ck = _ckpt()
    write_atomic(path, ck)
    good, err = read_file(path)
    assert err is None and torch.equal(good["model"]["0.weight"], ck["model"]["0.weight"])
    assert good["epoch"] == 3 and "sha256" not in good
    raw = bytearray(open(path, "rb").read())
    needle = ck["model"]["0.weight"][10].numpy().tobytes()  # a row's bytes, stored verbatim
    at = bytes(raw).find(needle)
    assert at > 0
    raw[at:at + 64] = bytes(b ^ 0xFF for b in raw[at:at + 64])
    open(path, "wb").write(raw)
    bad, err = read_file(path)
    assert bad is None and err[0] == "bad" and path in err[1] and "corrupted" in err[1]


def test_checkpoint_without_a_digest_still_loads(tmp_path):
    path = str(tmp_path / "old.pt")
    torch.save(_ckpt(), path)  # as written before the digest existed
    ck, err = read_file(path)
    assert err is None and ck["epoch"] == 3
