"""Data in: MNIST and image datasets loaded, checked, decoded, augmented, streamed and mixed, up to the device."""
