"""Redis plumbing shared by the prefix index, quota and fair-queue stores."""
