"""A stand-in for the few pieces of torchvision that pytorch/examples' mnist script uses, for
tests/test_loop.py on machines without torchvision or MNIST: `datasets.MNIST` reads
Fashion-MNIST's IDX files (the same format and shapes, found as ako finds them), cut to
$STUB_MNIST_SAMPLES samples; `transforms` are ToTensor, Normalize and Compose."""

from torchvision import datasets, transforms  # noqa: F401
