from datamodules.hierarchy import HierarchyDataModule  # noqa: F401
