from ako.cli import main

raise SystemExit(main())
