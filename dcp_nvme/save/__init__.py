"""The save path: ``NVMeWriter`` (DCP's StorageWriter) resolves each item to bytes (``items``),
places them in one container per rank (``format.placement``), writes it through an engine under
the node's queue budget (``node_budget``), and commits the manifest; ``NVMeStager`` copies the
state into a reused arena for ``dcp.async_save``, in bounded waves (``waves``); ``NVMeAsyncSaver``
runs such saves on one persistent thread (``async_saver``)."""
