"""Plain nn.Module builders; models never see federation."""

from models.cnn import SmallCNN
from models.gpt2_lora import LoRAClassifier
from models.mlp import MLP

__all__ = ["MLP", "LoRAClassifier", "SmallCNN"]
