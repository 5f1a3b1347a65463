"""Typed run configuration: schema, YAML + dotted overrides, validation, resolved dump."""
from opkd_mcore.config.loader import (
    ConfigError,
    apply_overrides,
    dump_config,
    from_dict,
    load_config,
    to_dict,
)
from opkd_mcore.config.model_checks import launch_world_size
from opkd_mcore.config.schema import (
    CheckpointSection,
    ControllerSection,
    DataSection,
    LoggingSection,
    LossSection,
    ModelSection,
    ParallelSection,
    RolloutSection,
    RunSection,
    TeacherEndpoint,
    TeacherSection,
    TrainConfig,
    WeightSyncSection,
)
from opkd_mcore.config.validate import validate_config

__all__ = [
    "CheckpointSection", "ConfigError", "ControllerSection", "DataSection", "LoggingSection", "LossSection",
    "ModelSection",
    "ParallelSection", "RolloutSection", "RunSection", "TeacherSection",
    "TeacherEndpoint", "TrainConfig", "WeightSyncSection", "apply_overrides", "dump_config",
    "from_dict", "launch_world_size", "load_config", "to_dict", "validate_config",
]
