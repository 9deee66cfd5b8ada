"""Every writer and reader of output_dir's files: parts, journals, manifest, locks, status, history, object
storage, the OpenAI results file, the latest-attempt view, nightly chains. Knows files, not engines."""
