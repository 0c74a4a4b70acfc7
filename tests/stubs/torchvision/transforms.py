"""ToTensor (uint8 (H, W) -> float (1, H, W) in [0, 1]), Normalize and Compose."""

import torch


class ToTensor:
    def __call__(self, image):
        return torch.from_numpy(image).float().div_(255).unsqueeze(0)


class Normalize:
    def __init__(self, mean, std):
        self.mean, self.std = mean[0], std[0]

    def __call__(self, x):
        return (x - self.mean) / self.std


class Compose:
    def __init__(self, steps):
        self.steps = steps

    def __call__(self, x):
        for step in self.steps:
            x = step(x)
        return x
