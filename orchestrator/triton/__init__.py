"""Running real Triton servers (from the nvidia-pytriton wheel) and hosting our models in them."""
