import os
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore", message=".*litlogger.*")

if os.environ.get("PYTEST_XDIST_WORKER"):  # one process per core: each keeps to one thread, or they contend
    import torch

    torch.set_num_threads(1)
