from cosyedge_daemon.cli.main import main

raise SystemExit(main())
