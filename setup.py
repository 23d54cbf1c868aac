"""Packages of the wheel: ``fl_lightning`` with the repository's ``models/``, ``datamodules/`` and
``configs/`` folders mapped inside it (``fl_lightning.models``, ``fl_lightning.datamodules``,
``fl_lightning.configs``), so that installing the project adds one top-level name only."""

from setuptools import find_packages, setup

MAPPED = {"fl_lightning.models": "models", "fl_lightning.datamodules": "datamodules", "fl_lightning.configs": "configs"}

packages = find_packages(include=["fl_lightning", "fl_lightning.*"])
for name, folder in MAPPED.items():
    packages += [name, *(f"{name}.{sub}" for sub in find_packages(folder))]

setup(packages=packages, package_dir=MAPPED, package_data={"fl_lightning.configs": ["*.yaml"]})
