from veloxquant_mlx.server.cli import main

raise SystemExit(main())
