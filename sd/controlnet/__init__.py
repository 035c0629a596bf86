"""ControlNet: a trainable copy of the UNet's encoder that steers a frozen base through a conditioning image."""
