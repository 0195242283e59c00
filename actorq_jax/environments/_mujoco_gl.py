"""Defaults MUJOCO_GL to "disable" so dm_control needs no display.

Imported before dm_control; it has no effect if dm_control was imported
earlier in the process or if the user set MUJOCO_GL (e.g. to egl to render).
"""

import os

os.environ.setdefault("MUJOCO_GL", "disable")
