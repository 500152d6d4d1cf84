"""What a training run owns on disk and in the process: its run directories (:mod:`.directories`),
its lock (:mod:`.locks`), its signal handling (:mod:`.signals`) and its checkpoint callback
(:mod:`.checkpoint`)."""
