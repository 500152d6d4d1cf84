"""What a training run owns on disk and in the process: its run directories, its lock, its signal handling."""
