"""The save path: ``NVMeWriter`` (DCP's StorageWriter) resolves each item to bytes (``items``),
places them in one container per rank (``format.container``), writes it through an engine under
the node's queue budget (``nodes``), and commits the manifest from the ranks' records
(``results``), then runs what follows a commit (``after_commit``); ``NVMeStager`` copies the
state into a reused arena for ``dcp.async_save``, in bounded waves (``handoff.WaveRelease``);
``NVMeAsyncSaver`` runs such saves on one persistent thread (``async_saver``)."""
