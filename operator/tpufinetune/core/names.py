"""The resource's names in the API: a leaf module, so that every other module (the models,
validation, sizing) can import them without importing each other."""

GROUP = "tpufinetune.dev"
VERSION = "v1alpha1"
KIND = "TPUFineTune"
PLURAL = "tpufinetunes"
SINGULAR = "tpufinetune"
SHORT_NAMES = ("tft", "tpuft")
API_VERSION = f"{GROUP}/{VERSION}"
