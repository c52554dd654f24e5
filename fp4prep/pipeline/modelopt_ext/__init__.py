"""What fp4prep adds to NVIDIA ModelOpt: a CPU backend, its calibration algorithm (the recipe's
steps per layer), the quantizer config per recipe, all registered for one run by ``Session``."""
